"""Reading what binaries import: ELF (its own reader of the dynamic and version sections) and PE (pefile) closures, and the library classes
(system / driver / bundle / toolchain runtime) kept as data."""
