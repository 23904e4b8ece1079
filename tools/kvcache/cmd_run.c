/* Placeholder: replaced by the module's implementation. */
typedef int kvc__placeholder_cmd_run;
