/* being written */
typedef int kvc__placeholder_paged;
