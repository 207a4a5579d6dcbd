"""Post-merge repairs: what changes a merged model after the merge (FeatCal, SVC), behind one registry.

:mod:`featcal.repairs.registry` says what a repair is; :mod:`featcal.repairs.catalog` lists featcal's
(``get_repair``, ``available_repairs``); :mod:`featcal.repairs.apply` runs a weight-only repair over a
merged model folder. This package's ``__init__`` imports nothing, so the command line's options
(:mod:`featcal.repairs.options`) read without torch.
"""
