"""``python -m ditorch.tools script.py [args]``: run a script under the tools named by
``DITORCH_TOOLS`` without editing it."""
import runpy
import sys

from ditorch.tools.env import activate_from_environment


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit("usage: DITORCH_TOOLS=... python -m ditorch.tools script.py [args...]")
    activate_from_environment()
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
