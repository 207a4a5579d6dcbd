"""Files featcal reads and writes: hashes, atomic writes, user-named inputs, model folders, fault points."""
