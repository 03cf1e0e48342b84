from tinyserve.cli import main

raise SystemExit(main())
