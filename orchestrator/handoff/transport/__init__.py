"""What the backends and the endpoints share: the run's keys and MACs (auth), the wire format
(wire), Mooncake's RPC port range (ports) and the probe of the address SGLang would advertise
(reach)."""
