/* lowbit_cpu.c's work item, taken by its splits and by GEAR's helpers. */
#ifndef KVPRESS_LOWBIT_SPAN_H
#define KVPRESS_LOWBIT_SPAN_H

#include <stdint.h>

/* Which slots a work item reads and whose queries read them. Rectangular codes: data head dh = qh, slots
 * [t0, t1) of that head, allowed columns = slot numbers. Flat codes (one store of per-(row, head) runs): data
 * head 0, the run's slots [t0, t1) of the store, allowed columns counted from the run's first slot a0. */
typedef struct {
    int64_t dh, qh, t0, t1, a0, a_width;
    int64_t e0, e1; /* GEAR: the key outlier entries to look through: e0 <= e < e1 of `entries` (NULL: e itself) */
    const int64_t *entries;
} span;

#endif
