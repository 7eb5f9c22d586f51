"""The compiler: how a model is compiled (``compiler.CompilePlan``) with our Inductor pass that buckets and
reorders SimpleFSDP's collectives, the regions of regional compilation, the compiled collectives' record
(``comm_plan``), the CPU cost model and torch's compile caches (``cache``)."""
