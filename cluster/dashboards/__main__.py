from cluster.dashboards.writer import main

raise SystemExit(main())
