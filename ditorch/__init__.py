"""ditorch: train one model on a hyper-heterogeneous fleet."""
