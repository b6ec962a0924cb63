"""The catalog of real parts, as the device layer names it: ``diutil.datasheets.catalog``
(pure data, importable without torch), re-exported."""
from diutil.datasheets.catalog import *  # noqa: F401,F403
