"""Planning cluster runs without the cluster: the dry run (``run.run_dry_run``) and the layout search
(``search.run_search``). Imports only the core (``core/``) and below, never the trainer."""
