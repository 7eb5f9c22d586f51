"""What every run shares: the plan (every decision), the build, the step, and the assembly of the three
(``assemble.build_run``) that the trainer, the dry run, the tests and the scripts call."""
