/* placeholder */
typedef int kvc__placeholder;
