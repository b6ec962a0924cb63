"""Small utilities every layer shares: loss logs (``diutil.loss_log``), server addresses and
ports (``diutil.address``), and the datasheets of chips and links (``diutil.datasheets``), pure
data that loads no torch. The lowest layer with ``dimodel``: it imports no other package."""
