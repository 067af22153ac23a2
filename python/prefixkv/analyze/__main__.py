"""`python -m prefixkv.analyze TRACE`: the same as `prefixkv analyze TRACE`."""

from prefixkv.apps.cli import analyze_main

raise SystemExit(analyze_main())
