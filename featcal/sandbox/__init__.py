"""A sandbox for model-generated code, and pass@k over its outcomes (HumanEval+/MBPP+-style coding benchmarks).

:func:`~featcal.sandbox.runner.run_program` runs one program with limits in separate Linux namespaces
(:mod:`.runner`, :mod:`.confine`), showing it read-only the folders of an installed package such as numpy
wherever they lie (:mod:`.packages`); :mod:`.scoring` runs each sample of each problem and computes pass@k
(:mod:`.passk`); :mod:`.files` reads problems and completions from JSONL files for ``featcal code-eval``
(:mod:`.options`). Running generated code is opt-in: every entry point refuses without
``allow_code_execution=True``. What the sandbox guarantees, and where: ``docs/code-eval.md``.
"""
