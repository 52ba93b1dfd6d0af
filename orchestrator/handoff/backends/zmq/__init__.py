"""The tcp route: the rows as AUX_DATA frames on the decode's data socket (router) and the
process's backend (backend)."""
