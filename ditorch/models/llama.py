"""``ditorch.models.llama``: the project's LLaMA, defined in ``dimodel.llama``."""
from dimodel.llama import *  # noqa: F401,F403
from dimodel.llama import __all__  # noqa: F401
