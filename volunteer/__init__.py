"""Training on unreliable devices: pipeline stages that are parameter-server groups.

Reliable devices run the stage servers (frontal servers take activations in, backward
servers pass them on); any device may join a stage as a client and leave without warning,
because every piece of work is a task in the servers' pool that another client can redo.
``plan`` allocates devices to stages (``allocate``), ``server`` and ``client`` run the job.
See docs/volunteer.md.
"""
