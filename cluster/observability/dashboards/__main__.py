from cluster.observability.dashboards.writer import main

raise SystemExit(main())
