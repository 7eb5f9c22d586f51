"""Planning cluster runs without the cluster: the dry run (``dry_run.run_dry_run``)."""
