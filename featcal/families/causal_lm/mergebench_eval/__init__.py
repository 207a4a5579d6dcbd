"""MergeBench's five-domain evaluation of a language model (``featcal run --eval-protocol mergebench``).

:mod:`.protocol` says what is run (tasks, metrics, settings and where each comes from); :mod:`.local_data`
points lm-evaluation-harness's task definitions at local copies of the benchmarks' data; :mod:`.coding`
samples programs as bigcode-evaluation-harness does and runs them in featcal's sandbox; :mod:`.runner`
runs the protocol on a model; :mod:`.scores` combines the results into per-domain scores and averages;
:mod:`.card` shows them in a model card; :mod:`.nltk_data` checks the nltk data ifeval reads;
:mod:`.judged_safety` and :mod:`.wildguard` run MergeBench's own safety protocol (answers judged by
WildGuard), the default (``--mergebench-safety fusionbench`` runs FusionBench's variant instead).
``docs/causal-lm.md`` describes it.
"""
