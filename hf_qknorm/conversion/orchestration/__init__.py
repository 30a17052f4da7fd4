"""Running a conversion: the request and its checks, the source and its texts, the destination and its temporary
folders, the processes of a launched run, progress, and what the written folder is measured by (answer agreement,
the coverage table's conversion column)."""
