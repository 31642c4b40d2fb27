from tools.scalesim.main import main

raise SystemExit(main())
