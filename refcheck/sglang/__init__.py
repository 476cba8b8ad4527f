"""Everything refcheck does with SGLang, in one package: code SGLang loads into its own processes, and code that
drives SGLang from outside.

Inside SGLang's processes (loaded through the ``sglang.srt.plugins`` entry point):

* ``plugin`` (``refcheck.sglang.plugin:register``, the entry point): the model fixes, the REFCHECK_DDTREE
  registration, then the capture hooks; the one module that imports both ``capture`` and ``ddtree``;
* ``capture/``: what records SGLang's verify steps (hooks, shipper, packing, records, expand, steps, state,
  DFLASH's drafter taps, layer sketches, the GDN probe, the injected sampler fault, the SGLang-version
  differences) and reads them back into a trace (``assemble``); ``gdn_probe_check`` / ``gdn_replay`` check the
  GDN kernels on what the probe recorded;
* ``ddtree/``: refcheck's DDTree as an SGLang speculative algorithm (``REFCHECK_DDTREE``, its leaky, shadow and
  fault twins, its keyed sampler);
* shared by both, importing neither: ``layout`` (SGLang's tensors <-> refcheck's layouts), ``draft_side`` (the
  drafter's side of a step as a record holds it) and ``env`` (the capture directory's environment names).

Driving SGLang from outside: ``runner`` (:class:`~refcheck.sglang.runner.SGLangRunner`, the ``sglang`` engine
of :mod:`refcheck.engines`), ``pair`` (the checkpoints it hands SGLang, and the refusals they call for),
``requests`` (a request's sampling params and the sampled runs' refusals), ``child`` (the engine process it
starts), ``settings`` (how SGLang serves), and on
top of the runner ``matrix`` (``refcheck matrix``), ``sweep`` (``refcheck sweep --engine sglang``) and
``capture_effect`` (the matrix's capture-off twins judged).

Direction (tests/test_layers.py): ``env`` / ``layout`` / ``draft_side`` <- ``capture``, ``ddtree`` <- ``plugin``
and ``runner`` / ``child`` <- ``matrix`` / ``sweep``; ``capture`` and ``ddtree`` never import each other or the
outside parts. The package stands on the trace format, the reference and the diff's public modules
(``diff.explain``, ``place``, ``session``, ``tolerance``); the trace format, the diff, the report and the goldens
never import it.
"""
