from tools.sim.scalesim.main import main

raise SystemExit(main())
