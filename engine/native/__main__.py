from engine.native import main

raise SystemExit(main())
