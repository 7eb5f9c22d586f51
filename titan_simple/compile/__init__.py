"""The compiler: what ``[compile]`` means for a run (``compile_plan.CompilePlan``, importable without Inductor),
our Inductor pass that buckets and reorders SimpleFSDP's collectives (``compiler``), the regions of regional
compilation, the compiled collectives' record (``comm_plan``), the CPU cost model, torch's compile caches
(``cache``), compiling each graph on one rank (``once``) and the compiler's private torch APIs
(``inductor_private``)."""
