from engy_node.cli import main

raise SystemExit(main())
