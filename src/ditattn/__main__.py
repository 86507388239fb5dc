from ditattn.cli import main

raise SystemExit(main())
