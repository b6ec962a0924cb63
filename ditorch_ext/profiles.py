"""Chip profiles, as the device layer names them: the datasheets of ``diutil.datasheets.chips``
(pure data, importable without torch), re-exported so ``ditorch_ext.profiles.X`` keeps working."""
from diutil.datasheets.chips import *  # noqa: F401,F403
