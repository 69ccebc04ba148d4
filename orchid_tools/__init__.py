"""Tools around the gateway runtime: the command line, demo, capacity worksheet,
isolation audit and simulator. They import ``gateway``; ``gateway`` never imports them."""
