from streamtrain.cli import main

raise SystemExit(main())
