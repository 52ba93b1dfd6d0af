"""The backends: what carries a step's aux rows and their statuses to a decode process, one
folder per backend (mooncake: the engine route; zmq: the tcp route) behind the small interface
of base (Backend, SendPath), as SGLang's disaggregation/<backend>/ behind its base/conn.py;
factory picks the plan's, common holds what both routes' send paths share."""
