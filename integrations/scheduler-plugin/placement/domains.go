package placement

import (
	"encoding/json"
	"fmt"
	"strconv"
	"strings"

	v1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	resourcelisters "k8s.io/client-go/listers/resource/v1"
	"k8s.io/client-go/tools/cache"
)

// The ComputeDomain contract: the controller labels the workload ResourceClaimTemplate
// with its domain's uid and puts the uid in the template's opaque config for our driver.
const (
	domainLabel = "resource.nvidia.com/computeDomain"
	driverName  = "compute-domain.nvidia.com"
	// The gang size a pod may state, as the advisor's extender reads it.
	sizeAnnotation = "resource.nvidia.com/computeDomainSize"
	uidIndex       = "uid"
)

var computeDomains = schema.GroupVersionResource{Group: "resource.nvidia.com", Version: "v1beta1", Resource: "computedomains"}

// domainOf finds the ComputeDomain a pod belongs to through the ResourceClaimTemplates it names;
// "" when it names none of a domain (then the pod is not ours).
func domainOf(pod *v1.Pod, templates resourcelisters.ResourceClaimTemplateLister) (string, error) {
	for _, claim := range pod.Spec.ResourceClaims {
		if claim.ResourceClaimTemplateName == nil || *claim.ResourceClaimTemplateName == "" {
			continue
		}
		template, err := templates.ResourceClaimTemplates(pod.Namespace).Get(*claim.ResourceClaimTemplateName)
		if apierrors.IsNotFound(err) {
			continue // the resourceclaim controller cannot make the claim either; DRA reports it
		}
		if err != nil {
			return "", err
		}
		if uid := template.Labels[domainLabel]; uid != "" {
			return uid, nil
		}
		for _, config := range template.Spec.Spec.Devices.Config {
			if config.Opaque == nil || config.Opaque.Driver != driverName {
				continue
			}
			var params struct {
				DomainID string `json:"domainID"`
			}
			if json.Unmarshal(config.Opaque.Parameters.Raw, &params) == nil && params.DomainID != "" {
				return params.DomainID, nil
			}
		}
	}
	return "", nil
}

// gangSize is how many nodes the pod's domain wants: the pod's size annotation, else the
// ComputeDomain's spec.numNodes; 0 = not known (the gang then grows one node at a time).
func gangSize(pod *v1.Pod, domainUID string, domains cache.Indexer) (int32, error) {
	if raw, ok := pod.Annotations[sizeAnnotation]; ok {
		size, err := strconv.ParseInt(strings.TrimSpace(raw), 10, 32)
		if err != nil || size <= 0 {
			return 0, fmt.Errorf("pod annotation %s=%q: must be a positive integer", sizeAnnotation, raw)
		}
		return int32(size), nil
	}
	if domains == nil {
		return 0, nil
	}
	found, err := domains.ByIndex(uidIndex, domainUID)
	if err != nil || len(found) == 0 {
		return 0, err
	}
	obj, ok := found[0].(*unstructured.Unstructured)
	if !ok {
		return 0, nil
	}
	numNodes, _, _ := unstructured.NestedInt64(obj.Object, "spec", "numNodes")
	if numNodes < 0 {
		numNodes = 0
	}
	return int32(numNodes), nil
}

func byUID(obj interface{}) ([]string, error) {
	if u, ok := obj.(*unstructured.Unstructured); ok {
		return []string{string(u.GetUID())}, nil
	}
	return nil, nil
}
