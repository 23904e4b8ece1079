/* Placeholder: replaced by the module's implementation. */
typedef int kvc__placeholder_prefill_avx2;
