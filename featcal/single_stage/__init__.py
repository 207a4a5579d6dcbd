"""The single-stage commands' work, one module each: ``featcal merge`` (:mod:`.merge`), ``featcal calibrate``
with FeatCal (:mod:`.calibrate`) or another repair (:mod:`.repair`), ``featcal evaluate`` (:mod:`.evaluate`).

Each function checks its output, opens the processes' session, prepares its inputs through
:func:`featcal.prepare.prepare`, computes and writes; it raises typed errors of :mod:`featcal.errors` and
prints nothing (the CLI words its result).
"""
