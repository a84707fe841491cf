from llmscale.cli import main

raise SystemExit(main())
