"""Small utilities every layer shares: loss logs (``diutil.loss_log``) and server addresses and
ports (``diutil.address``). The lowest layer with ``dimodel``: it imports no other package."""
