"""The profile: what a run declares (config: the schema, a docstring under each field; kinds: its
vocabulary, the enums and ConfigError), the one rule book that the run, doctor and export_env
apply (rules), the pure plan it yields (plan), the aux layout as data (layout) and what this host
has (platform). The ground floor: it imports nothing from results/, handoff/ or job/ (what each
fault kind is, fault_table, and the processes' names, proc_names, live here for the floors
above). Pure: nothing here moves a byte."""
