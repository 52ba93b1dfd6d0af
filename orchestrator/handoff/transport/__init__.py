"""What the backends and the endpoints share: the run's keys and MACs (auth), the wire format
(wire), what a side tells about itself before any handoff (advert: a decode's endpoints, the
address SGLang would advertise), Mooncake's RPC port range (ports) and the probe of that
address (reach). A split run's two hosts meet here too, before any handoff (bootstrap and its
peer checks, peercheck: the runner calls them with a BootstrapSpec)."""
