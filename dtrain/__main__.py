from dtrain.cli.app import main

raise SystemExit(main())
