"""The Ray Serve application and the command line (DESIGN §6)."""
