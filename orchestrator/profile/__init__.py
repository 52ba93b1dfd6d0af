"""The profile: what a run declares (config: the schema, a docstring under each field), the one
rule book that the run, doctor and export_env apply (rules), the pure plan it yields (plan), the
aux layout as data (layout) and what this host has (platform). Pure: nothing here moves a byte."""
