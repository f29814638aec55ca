from atom_plugin.cli import main

raise SystemExit(main())
