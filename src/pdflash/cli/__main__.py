"""`python -m pdflash.cli`: the same as the `pdflash` command."""

from pdflash.cli.parser import main

raise SystemExit(main())
