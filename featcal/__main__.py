"""`python -m featcal`: the same as the `featcal` command."""

from featcal.cli import main

raise SystemExit(main())
