"""Real I/O: the Mooncake transfer engine and the ZMQ AUX_DATA route."""
