"""``ditorch.datasets``: the datasets, defined in ``dimodel.datasets``."""
from dimodel.datasets import *  # noqa: F401,F403
from dimodel.datasets import __all__  # noqa: F401
