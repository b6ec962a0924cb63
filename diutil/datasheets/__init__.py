"""Datasheets: what the fleet's parts are, as pure data every layer reads.

``chips`` holds the chip profiles (H2's chips A-D, the host, user profiles from
``$DITORCH_PROFILE_FILE``) and the job's time scale; ``catalog`` the real parts by their vendors'
figures. The planner, the simulator, the runtime and the device layer read the same entries, so
they sit at the bottom of the layers and import neither torch nor any compiled module: a fleet of
catalog parts plans on a machine without either (docs/device.md, "Catalog").
"""
from diutil.datasheets import chips  # noqa: F401  (first: the catalog's entries are its ChipProfiles)
