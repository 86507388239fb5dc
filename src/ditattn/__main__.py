from ditattn.entrypoints.cli import main

raise SystemExit(main())
