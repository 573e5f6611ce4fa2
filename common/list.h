/* An intrusive doubly-linked list, for objects that sit in several lists. */
#ifndef GPUMEM_LIST_H
#define GPUMEM_LIST_H

#include <stdbool.h>
#include <stddef.h>

struct list {
  struct list *prev, *next;
};

/* Make an empty list (or an unlinked node). */
static inline void list_init(struct list *l) { l->prev = l->next = l; }

/* True if the list has no entries. */
static inline bool list_empty(const struct list *l) { return l->next == l; }

/* Add node at the tail of list. */
static inline void list_append(struct list *list, struct list *node) {
  node->prev = list->prev;
  node->next = list;
  list->prev->next = node;
  list->prev = node;
}

/* Add node at the head of list. */
static inline void list_prepend(struct list *list, struct list *node) {
  node->prev = list;
  node->next = list->next;
  list->next->prev = node;
  list->next = node;
}

/* Take node out of its list; it becomes an empty list of its own. */
static inline void list_remove(struct list *node) {
  node->prev->next = node->next;
  node->next->prev = node->prev;
  list_init(node);
}

/* Number of nodes in a list (walks it). */
static inline size_t list_count(const struct list *l) {
  size_t n = 0;
  for (const struct list *p = l->next; p != l; p = p->next) n++;
  return n;
}

/* The structure that holds a list node. */
#define list_entry(node, type, member) \
  ((type *)((char *)(node) - offsetof(type, member)))

/* Walk a list; safe against removing the current entry. */
#define list_for_each_safe(pos, tmp, head) \
  for (pos = (head)->next, tmp = pos->next; pos != (head); pos = tmp, tmp = pos->next)

#endif
