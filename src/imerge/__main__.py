from imerge.cli import main

raise SystemExit(main())
