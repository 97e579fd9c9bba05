"""Reading what binaries import: ELF (pyelftools) and PE (pefile) closures, and the library classes
(system / driver / bundle / toolchain runtime) kept as data."""
