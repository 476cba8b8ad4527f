"""DDTree as an SGLang speculative algorithm (``REFCHECK_DDTREE``), registered by refcheck's plugin
(:mod:`refcheck.sglang.plugin`).

Modules: ``layout`` (pure: DDTree trees -> SGLang's NGRAM-style draft tokens + ancestor masks),
``drafts`` (the DFlash drafter over SGLang's own embedding and head, one context per request),
``worker`` (the SGLang worker: draft -> tree -> SGLang tree verify on the hybrid backend's per-node
path -> greedy walk -> commit and KV compaction -> draft context; imports SGLang) and ``algorithm``
(the registration, safe to call where SGLang is absent). The layouts and the drafter's side it shares
with the capture are :mod:`refcheck.sglang.layout` and :mod:`refcheck.sglang.draft_side`; nothing here imports
:mod:`refcheck.sglang.capture`.

Correctness first: the drafter is refcheck's pure-PyTorch DFlash drafter (tested equal to z-lab's
``dflash``) fed with SGLang's captured target hidden states, and the tree is refcheck's Algorithm 1;
everything from the verify on is SGLang's own code (NGRAM's tree-verify path), which is what the
diff exercises. Greedy only, tensor parallelism 1, overlap scheduling off; CUDA graphs on or off
(under graphs the target's tree verify replays SGLang's captured verify graph, the drafter stays eager).
"""
